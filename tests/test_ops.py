import torch
from hypothesis import given
from hypothesis import strategies as st

from nopad.core import index_first_axis, index_put_first_axis, pad_input, unpad_input

masks = st.lists(st.lists(st.integers(0, 1), min_size=4, max_size=4), min_size=1, max_size=5)


@given(mask=masks)
def test_unpad_input_matches_flash_attn_semantics(mask):
    mask = torch.tensor(mask)
    hidden = torch.randn(*mask.shape, 3)
    out, indices, cu_seqlens, max_seqlen, seqused = unpad_input(hidden, mask)
    assert torch.equal(out, hidden[mask.bool()])
    assert torch.equal(indices, mask.flatten().nonzero().flatten())
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, *mask.sum(-1).cumsum(0).tolist()]
    assert max_seqlen == int(mask.sum(-1).max()) and isinstance(max_seqlen, int)
    assert seqused.dtype == torch.int32 and torch.equal(seqused, mask.sum(-1).int())
    assert torch.equal(pad_input(out, indices, *mask.shape), hidden * mask.unsqueeze(-1))


def test_unused_mask_keeps_tokens_but_not_in_seqused():
    mask = torch.tensor([[1, 1, 0, 0]])
    unused = torch.tensor([[0, 0, 1, 0]])
    out, _, cu_seqlens, max_seqlen, seqused = unpad_input(torch.arange(4.0).view(1, 4, 1), mask, unused)
    assert out.flatten().tolist() == [0.0, 1.0, 2.0]
    assert cu_seqlens.tolist() == [0, 3] and max_seqlen == 3 and seqused.tolist() == [2]


def test_index_functions_are_autograd_exact_inverses():
    x = torch.randn(7, 2, dtype=torch.float64, requires_grad=True)
    idx = torch.tensor([5, 0, 3])
    assert torch.autograd.gradcheck(lambda t: index_first_axis(t, idx), (x,))
    v = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: index_put_first_axis(t, idx, 7), (v,))
    assert torch.equal(index_first_axis(index_put_first_axis(v, idx, 7), idx), v)
