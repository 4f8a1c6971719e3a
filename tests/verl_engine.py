"""verl's own training path on CPU ranks, for tests/test_integration_verl_ranks.py: its FSDP engine
(``FSDPEngineWithLMHead``, FSDP2 over gloo) inside its ``TrainingWorker``, its worker group's DP
dispatch and collect (``_split_args_kwargs_data_proto``, ``_concat_data_proto_or_future``) and its
trainer's steps around them, on a tiny random-weight Qwen2 built from a config (no download).

verl 0.9.1 has no CPU platform: :func:`use_cpu` registers one (devices are "cpu", collectives gloo)
and points the engine registry at the engine verl registers for CUDA. Nothing else of verl is
changed. Each rank runs the same steps twice, verl alone and then under ``install()``, each time
with a fresh worker built from the same weights.
"""

from __future__ import annotations

import os
import pickle
import sys
import types
from collections import Counter
from functools import partial
from typing import Any

import torch

VOCAB = 128
# measurements, not results: wall-clock based (mfu) or read from the host (memory)
MEASURED = ("mfu", "perf/cpu_memory_used_gb")


def save_tiny_model(path: str, hidden: int = 32, layers: int = 2, positions: int = 128) -> None:
    """A 2-layer Qwen2 with random weights (seed 0), saved where verl's HFModelConfig loads it
    (``hidden`` / ``layers`` / ``positions``: a larger one, for a timing)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        tie_word_embeddings=False,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)


def save_tiny_hybrid(path: str, family: str = "qwen3_5_text") -> None:
    """A tiny random-weight model of ``family`` (seed 0; nopad's tiny config, verl's vocabulary here),
    saved where verl's HFModelConfig loads it."""
    from transformers import AutoModelForCausalLM

    from nopad._apps.families import tiny_config

    config = tiny_config(family)
    config.vocab_size, config.tie_word_embeddings = VOCAB, False
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)


def use_cpu() -> None:
    """verl's platform singleton as a CPU: device "cpu", memory readings 0, gloo; the FSDP engine
    verl registers for CUDA chosen for it (its code is device-generic given the platform)."""
    from verl.plugin.platform import platform_manager
    from verl.plugin.platform.platform_cuda import PlatformCUDA

    module = types.SimpleNamespace(
        current_device=lambda: "cpu",
        device_count=lambda: 1,
        set_device=lambda *a: None,
        synchronize=lambda *a: None,
        manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed,
        empty_cache=lambda: None,
        max_memory_allocated=lambda *a: 0,
        max_memory_reserved=lambda *a: 0,
        memory_allocated=lambda *a: 0,
        memory_reserved=lambda *a: 0,
        mem_get_info=lambda *a: (0, 0),
        reset_peak_memory_stats=lambda *a: None,
        is_available=lambda: True,
        get_rng_state=torch.get_rng_state,
        set_rng_state=torch.set_rng_state,
        get_device_name=lambda *a: "CPU",
    )

    class PlatformCPU(PlatformCUDA):
        device_name = property(lambda self: "cpu")
        device_module = property(lambda self: module)

        def is_available(self) -> bool:
            return True

        def current_device(self) -> Any:
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: Any) -> None:
            pass

        def synchronize(self, device_index: Any = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def empty_cache(self) -> None:
            pass

        def communication_backend_name(self) -> str:
            return "gloo"

    platform_manager.set_platform(PlatformCPU())
    os.environ["VERL_ENGINE_DEVICE"], os.environ["VERL_ENGINE_VENDOR"] = "cuda", "nvidia"


def padded_batch(rows: int, seed: int = 0):
    """A rollout batch as verl's trainer holds it before its first conversion: left-padded prompts,
    right-padded responses, prompts / responses, rewards' advantages; lengths vary by row."""
    from tests.batches import make_batch

    g = torch.Generator().manual_seed(seed)
    P, R = 6, 5
    prompt_lens = torch.randint(1, P + 1, (rows,), generator=g).tolist()
    resp_lens = torch.randint(1, R + 1, (rows,), generator=g).tolist()
    td = make_batch(prompt_lens, resp_lens, P, R, extras=False, seed=seed)
    td["input_ids"] = td["input_ids"] % VOCAB
    td["prompts"], td["responses"] = td["input_ids"][:, :P], td["input_ids"][:, P:]
    td["advantages"] = torch.randn(rows, R, generator=g)
    return td


def _worker(model_dir: str, world: int, dynamic: bool, rows_per_rank: int, micro: int = 2, compile: bool = False):
    """verl's TrainingWorker on its FSDP engine (FSDP2, fp32), with verl's ppo_loss as the actor's;
    ``compile``: verl's ``use_torch_compile`` (its default, True, compiles the engine's entropy)."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import (
        FSDPActorConfig,
        FSDPEngineConfig,
        FSDPOptimizerConfig,
        HFModelConfig,
        TrainingWorkerConfig,
    )
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss

    # tokens per micro-batch (24 at micro=2: 2 to 4 micro-batches of a rank's rows of 2 to 11 tokens)
    budget = 12 * micro
    model = HFModelConfig(
        path=model_dir, load_tokenizer=False, use_remove_padding=True, override_config={"attn_implementation": "sdpa"}
    )
    fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    engine = FSDPEngineConfig(
        strategy="fsdp2",
        fsdp_size=world,
        use_dynamic_bsz=dynamic,
        max_token_len_per_gpu=budget,
        infer_max_token_len_per_gpu=budget,
        micro_batch_size_per_gpu=micro,
        infer_micro_batch_size_per_gpu=micro,
        model_dtype="fp32",
        mixed_precision=fp32,
        use_torch_compile=compile,
    )
    worker = TrainingWorker(
        TrainingWorkerConfig(
            model_type="language_model",
            model_config=model,
            engine_config=engine,
            optimizer_config=FSDPOptimizerConfig(lr=1e-2),
            checkpoint_config=CheckpointConfig(),
        )
    )
    worker.reset()
    actor = FSDPActorConfig(
        strategy="fsdp2",
        rollout_n=1,
        ppo_mini_batch_size=rows_per_rank * world,
        ppo_micro_batch_size_per_gpu=micro,
        use_dynamic_bsz=dynamic,
        ppo_max_token_len_per_gpu=budget,
        clip_ratio=0.2,
        loss_agg_mode="token-mean",
        entropy_coeff=0.01,
        use_kl_loss=True,
        kl_loss_type="low_var_kl",
        kl_loss_coef=0.05,
    )
    worker.set_loss_fn(partial(ppo_loss, config=actor))
    return worker


def _over_the_wire(td):
    """What Ray does to a TensorDict between the driver and a worker: a pickle round trip (verl's
    dispatch consolidates, and so locks, each rank's part)."""
    return pickle.loads(pickle.dumps(td))


def _driver_collect(output, world: int):
    """The driver's collect of every rank's output, as verl's worker group makes it."""
    from verl.single_controller.base.decorator import _concat_data_proto_or_future

    outputs: list[Any] = [None] * world
    torch.distributed.all_gather_object(outputs, _over_the_wire(output))
    return _concat_data_proto_or_future(outputs)


def trainer_step(rank: int, world: int, model_dir: str, dynamic: bool, rows_per_rank: int) -> dict:
    """One step of verl's PPO trainer with this rank as one of ``world`` DP workers: the old log-probs
    pass (``_compute_old_log_prob``: convert, dispatch, ``infer_batch``, collect, read the metrics'
    mfu, back to padded), then one actor update (``_update_actor``: dispatch, ``train_mini_batch``
    with verl's ppo_loss, one optimizer step). Every rank plays the driver for itself (the same
    deterministic split and collect), so each holds what verl's single controller would."""
    import verl.utils.tensordict_utils as tu
    import verl.workers.utils.padding as vpad
    from verl.single_controller.base.decorator import _split_args_kwargs_data_proto

    worker = _worker(model_dir, world, dynamic, rows_per_rank)
    rows = rows_per_rank * world

    # _compute_old_log_prob
    batch = vpad.left_right_2_no_padding(padded_batch(rows))
    tokens = batch["attention_mask"].sum(-1).tolist()
    tu.assign_non_tensor(batch, calculate_entropy=True, compute_loss=False, global_token_num=tokens, temperature=1.0)
    (parts,), _ = _split_args_kwargs_data_proto(world, batch)
    infer_output = worker.infer_batch(_over_the_wire(parts[rank]))
    collected = _driver_collect(infer_output, world)
    old_log_prob_mfu = tu.get(collected, "metrics")["mfu"]  # ray_trainer.py's own read (issue 27's TypeError)
    old_log_probs = vpad.no_padding_2_padding(tu.get(collected, "log_probs"), batch).float()
    entropys = vpad.no_padding_2_padding(tu.get(collected, "entropy"), batch).float()

    # _update_actor
    update = padded_batch(rows)
    update["old_log_probs"] = old_log_probs
    update["ref_log_prob"] = old_log_probs - 0.05 * torch.randn(
        old_log_probs.shape, generator=torch.Generator().manual_seed(1)
    )
    update = vpad.left_right_2_no_padding(update)
    tu.assign_non_tensor(
        update,
        calculate_entropy=True,
        global_batch_size=rows,
        mini_batch_size=rows,
        epochs=1,
        seed=1,
        dataloader_kwargs={"shuffle": True},
        compute_loss=True,
        temperature=1.0,
        global_token_num=update["attention_mask"].sum(-1).tolist(),
    )
    (parts,), _ = _split_args_kwargs_data_proto(world, update)
    train_output = worker.train_mini_batch(_over_the_wire(parts[rank]))
    weights = {
        key: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
        for key, value in worker.engine.module.state_dict().items()
    }
    return {
        "infer_output": infer_output,
        "collected": collected,
        "old_log_prob_mfu": old_log_prob_mfu,
        "old_log_probs": old_log_probs,
        "entropys": entropys,
        "train_metrics": tu.get(train_output, "metrics"),
        "weights": weights if rank == 0 else None,
    }


def _count_routes(counts: Counter):
    """A profile hook counting calls of nopad's verl routes (the functions in its integration modules)."""
    wanted = ("nopad/integrations/verl/_install.py", "nopad/integrations/verl/_rows.py")

    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.endswith(wanted):
            counts[frame.f_code.co_name] += 1

    return hook


def alone_then_installed(rank: int, world: int, model_dir: str, rows_per_rank: int) -> dict:
    """On one rank: the trainer step with and without use_dynamic_bsz, verl alone, then the same under
    ``install()`` (with the calls of nopad's routes counted)."""
    use_cpu()
    torch.manual_seed(0)
    results: dict[str, Any] = {}
    for dynamic in (False, True):
        results["alone", dynamic] = trainer_step(rank, world, model_dir, dynamic, rows_per_rank)
    from nopad.integrations import verl as nopad_verl

    with nopad_verl.install():
        for dynamic in (False, True):
            counts: Counter = Counter()
            sys.setprofile(_count_routes(counts))
            try:
                results["installed", dynamic] = trainer_step(rank, world, model_dir, dynamic, rows_per_rank)
            finally:
                sys.setprofile(None)
            results["routes_called", dynamic] = dict(counts)
    return results


# ---- install(share_prefixes=True): a GRPO step with each group's prompt computed once ----------------
GROUP = 4  # rows per prompt (verl's rollout.n)


def grpo_batch(groups: int, seed: int = 0, n: int = GROUP, prompt: int = 8, response: int = 4):
    """A rollout batch shaped as GRPO's: ``groups`` prompts (1 to ``prompt`` tokens), each sampled ``n``
    times (its rows' prompt tokens and left padding equal, their responses of 1 to ``response`` tokens
    their own), with verl's ``uid`` per row as its trainer gives it (a string per group, in the
    non-tensor data)."""
    from tensordict import NonTensorData, NonTensorStack

    from tests.batches import make_batch

    g = torch.Generator().manual_seed(seed)
    P, R = prompt, response
    rows = groups * n
    prompt_lens = torch.randint(1, P + 1, (groups,), generator=g).repeat_interleave(n).tolist()
    resp_lens = torch.randint(1, R + 1, (rows,), generator=g).tolist()
    td = make_batch(prompt_lens, resp_lens, P, R, extras=False, seed=seed)
    leaders = torch.arange(rows) // n * n
    td["input_ids"][:, :P] = td["input_ids"][leaders, :P]  # each group's rows hold its first row's prompt
    td["input_ids"] = td["input_ids"] % VOCAB
    td["prompts"], td["responses"] = td["input_ids"][:, :P], td["input_ids"][:, P:]
    td["advantages"] = torch.randn(rows, R, generator=g)
    td["uid"] = NonTensorStack.from_list([NonTensorData(f"prompt-{int(r) // n}") for r in leaders])
    return td


def shared_step(
    rank: int, world: int, model_dir: str, dynamic: bool, groups_per_rank: int, compile: bool = False, on_worker=None
) -> dict:
    """verl's old-log-probs pass (``infer_batch``) and one actor update (``train_mini_batch`` with
    verl's ppo_loss, one optimizer step) on a GRPO batch, as :func:`trainer_step` runs them; returns
    the log-probs and entropy read back padded, the update's metrics (its loss among them), every
    parameter's gradient of the step and the weights after it (whole, on every rank). ``compile``:
    verl's ``use_torch_compile``; ``on_worker``: called with the worker once it is built."""
    import verl.utils.tensordict_utils as tu
    import verl.workers.utils.padding as vpad
    from verl.single_controller.base.decorator import _split_args_kwargs_data_proto

    worker = _worker(model_dir, world, dynamic, groups_per_rank * GROUP, micro=GROUP, compile=compile)
    if on_worker is not None:
        on_worker(worker)
    rows = groups_per_rank * GROUP * world
    batch = vpad.left_right_2_no_padding(grpo_batch(rows // GROUP))
    tokens = batch["attention_mask"].sum(-1).tolist()
    tu.assign_non_tensor(batch, calculate_entropy=True, compute_loss=False, global_token_num=tokens, temperature=0.7)
    (parts,), _ = _split_args_kwargs_data_proto(world, batch)
    collected = _driver_collect(worker.infer_batch(_over_the_wire(parts[rank])), world)
    old_log_probs = vpad.no_padding_2_padding(tu.get(collected, "log_probs"), batch).float()
    entropys = vpad.no_padding_2_padding(tu.get(collected, "entropy"), batch).float()

    update = grpo_batch(rows // GROUP)
    update["old_log_probs"] = old_log_probs
    update["ref_log_prob"] = old_log_probs - 0.05 * torch.randn(
        old_log_probs.shape, generator=torch.Generator().manual_seed(1)
    )
    update = vpad.left_right_2_no_padding(update)
    tu.assign_non_tensor(
        update,
        calculate_entropy=True,
        global_batch_size=rows,
        mini_batch_size=rows,
        epochs=1,
        seed=1,
        dataloader_kwargs={"shuffle": dynamic},  # whole groups per micro-batch; shuffled rows split them
        compute_loss=True,
        temperature=0.7,
        global_token_num=update["attention_mask"].sum(-1).tolist(),
    )
    (parts,), _ = _split_args_kwargs_data_proto(world, update)

    def whole(t):
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

    grads: dict = {}
    step = worker.engine.optimizer_step

    def step_reading_grads():  # the step's gradients as its backward left them, before clipping
        grads.update({key: whole(p.grad) for key, p in worker.engine.module.named_parameters()})
        return step()

    worker.engine.optimizer_step = step_reading_grads
    train_output = worker.train_mini_batch(_over_the_wire(parts[rank]))
    params = dict(worker.engine.module.named_parameters())
    return {
        "old_log_probs": old_log_probs,
        "entropys": entropys,
        "response_mask": batch["response_mask"],
        "train_metrics": tu.get(train_output, "metrics"),
        "grads": grads,
        "weights": {key: whole(p) for key, p in params.items()},
    }


def flag_off_then_on(rank: int, world: int, model_dir: str, groups_per_rank: int) -> dict:
    """On one rank: the GRPO step under ``install()`` with the flag off, then with
    ``share_prefixes=True`` (fresh workers from the same weights), with and without use_dynamic_bsz;
    with the flag on, what each micro-batch's forward took (shared or why not), the tokens each
    shared forward computed against the rows' own, and whether verl's uid reached the engine."""
    import nopad.engines._prefixes as prefixes
    import nopad.integrations.verl._shared as shared
    from nopad.integrations import verl as nopad_verl

    use_cpu()
    torch.manual_seed(0)
    results: dict[str, Any] = {}
    planned: list[tuple[int, int]] = []
    saw_uid: list[bool] = []
    plan, reason = prefixes.plan_shared_prefixes, shared.fallback_reason

    def counting_plan(*args, **kwargs):
        out = plan(*args, **kwargs)
        planned.append((out.total, out.rows_total))
        return out

    def seeing_uid(engine, micro_batch, loss_function):
        saw_uid.append("uid" in micro_batch.keys())
        return reason(engine, micro_batch, loss_function)

    prefixes.plan_shared_prefixes, shared.fallback_reason = counting_plan, seeing_uid
    try:
        for dynamic in (False, True):
            with nopad_verl.install():
                results["off", dynamic] = shared_step(rank, world, model_dir, dynamic, groups_per_rank)
            shared.COUNTS.clear()
            planned.clear()
            with nopad_verl.install(share_prefixes=True):
                results["on", dynamic] = shared_step(rank, world, model_dir, dynamic, groups_per_rank)
            results["counts", dynamic] = dict(shared.COUNTS)
            results["planned", dynamic] = list(planned)
    finally:
        prefixes.plan_shared_prefixes, shared.fallback_reason = plan, reason
    results["saw_uid"] = saw_uid
    return results


def flag_on(rank: int, world: int, model_dir: str, groups_per_rank: int) -> dict:
    """On one rank: the GRPO step of :func:`shared_step` under ``install(share_prefixes=True)``
    (use_dynamic_bsz off), and what each micro-batch's forward took (shared or why not)."""
    import nopad.integrations.verl._shared as shared
    from nopad.integrations import verl as nopad_verl

    use_cpu()
    torch.manual_seed(0)
    shared.COUNTS.clear()
    with nopad_verl.install(share_prefixes=True):
        results = shared_step(rank, world, model_dir, False, groups_per_rank)
    return {**results, "counts": dict(shared.COUNTS)}


# ---- verl's use_torch_compile (its default): the engine's entropy compiled by torch.compile ------------
def _watch_compiled_entropy(seen: list):
    """An ``on_worker`` hook: the engine's ``compute_entropy_from_logits`` (what ``use_torch_compile``
    compiles, ``torch.compile(entropy_from_logits, dynamic=True)``) wrapped to record, per call,
    whether it is verl's compiled function and the kind of tensor it was given."""

    def hook(worker) -> None:
        engine = worker.engine
        compiled = engine.compute_entropy_from_logits

        def counting(logits, *args, **kwargs):
            seen.append((hasattr(compiled, "_torchdynamo_orig_callable"), type(logits).__name__, logits.is_nested))
            return compiled(logits, *args, **kwargs)

        engine.compute_entropy_from_logits = counting

    return hook


def compile_on_and_off(rank: int, world: int, model_dir: str, groups_per_rank: int) -> dict:
    """On one rank: the GRPO step of :func:`shared_step` (fresh workers from the same weights), verl
    alone with ``use_torch_compile=True``, then under ``install()`` with it off and on, then under
    ``install(share_prefixes=True)`` with it off and on; for each run, the calls of the engine's
    entropy function (:func:`_watch_compiled_entropy`), torch.compile's graph breaks and compiled
    frames, the calls of nopad's routes and the shared layout's counts."""
    import torch._dynamo

    import nopad.integrations.verl._shared as shared
    from nopad.integrations import verl as nopad_verl

    use_cpu()
    torch.manual_seed(0)
    torch._dynamo.reset()
    results: dict[str, Any] = {}
    runs = {
        "alone": (None, True),
        "off": (False, False),
        "on": (False, True),
        "shared_off": (True, False),
        "shared": (True, True),
    }
    for name, (share, compile) in runs.items():
        seen: list = []
        counts: Counter = Counter()
        torch._dynamo.utils.counters.clear()
        shared.COUNTS.clear()
        handle = nopad_verl.install(share_prefixes=share) if share is not None else None
        sys.setprofile(_count_routes(counts))
        try:
            step = shared_step(rank, world, model_dir, False, groups_per_rank, compile, _watch_compiled_entropy(seen))
        finally:
            sys.setprofile(None)
            if handle is not None:
                handle.uninstall()
        dynamo = torch._dynamo.utils.counters
        results[name] = step
        results[name, "watch"] = {
            "entropy_calls": seen,
            "graph_breaks": sum(dynamo["graph_break"].values()),
            "frames_compiled": dynamo["frames"]["ok"],
            "routes": dict(counts),
            "shared": dict(shared.COUNTS),
        }
    return results


def timed_grpo_steps(rank: int, world: int, model_dir: str, n: int, prompt: int, response: int, rounds: int) -> dict:
    """Seconds of verl's old-log-probs pass and of one actor update (each the best of ``rounds``) on
    one micro-batch of 2 groups of ``n`` rows, under ``install()`` with share_prefixes off and on."""
    import time

    import verl.utils.tensordict_utils as tu
    import verl.workers.utils.padding as vpad

    from nopad.integrations import verl as nopad_verl

    use_cpu()
    rows = 2 * n
    times: dict[str, Any] = {}
    for flag in (False, True):
        with nopad_verl.install(share_prefixes=flag):
            worker = _worker(model_dir, world, False, rows, micro=rows)
            infer, update = [], []
            for _ in range(rounds):
                batch = vpad.left_right_2_no_padding(grpo_batch(2, n=n, prompt=prompt, response=response))
                tokens = batch["attention_mask"].sum(-1).tolist()
                tu.assign_non_tensor(batch, calculate_entropy=True, compute_loss=False, global_token_num=tokens)
                tu.assign_non_tensor(batch, temperature=1.0)
                start = time.perf_counter()
                worker.infer_batch(batch)
                infer.append(time.perf_counter() - start)
                padded = grpo_batch(2, n=n, prompt=prompt, response=response)
                padded["old_log_probs"] = padded["ref_log_prob"] = torch.zeros(rows, response)
                step = vpad.left_right_2_no_padding(padded)
                tu.assign_non_tensor(step, calculate_entropy=True, global_batch_size=rows, mini_batch_size=rows)
                tu.assign_non_tensor(step, epochs=1, seed=1, dataloader_kwargs={"shuffle": False}, compute_loss=True)
                tu.assign_non_tensor(step, temperature=1.0, global_token_num=tokens)
                start = time.perf_counter()
                worker.train_mini_batch(step)
                update.append(time.perf_counter() - start)
            times["on" if flag else "off"] = (min(infer), min(update))
    prompts = batch["attention_mask"][:, :prompt].sum(-1)
    times["tokens"] = int(batch["attention_mask"].sum())
    times["computed"] = times["tokens"] - (n - 1) * int(prompts[::n].sum())  # each group's prompt once
    return times


if __name__ == "__main__":  # python -m tests.verl_engine: the timing of docs/results.md (verl's venv)
    import tempfile

    from tests.dist_utils import run_distributed

    N, PROMPT, RESPONSE = 8, 512, 128
    with tempfile.TemporaryDirectory() as tmp:
        save_tiny_model(tmp, hidden=256, layers=4, positions=1024)
        (result,) = run_distributed(timed_grpo_steps, 1, tmp, N, PROMPT, RESPONSE, 3)
    print(f"2 groups of {N} rows, prompts of 1-{PROMPT} tokens, responses of 1-{RESPONSE}: {result['tokens']} tokens,")
    print(f"{result['computed']} with each group's prompt once")
    for flag in ("off", "on"):
        infer, update = result[flag]
        print(f"share_prefixes {flag}: old log-probs {1e3 * infer:.0f} ms, actor update {1e3 * update:.0f} ms")
