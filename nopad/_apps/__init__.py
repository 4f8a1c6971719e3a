"""The applications on top of the library: the ``nopad`` command line (``demo``, ``bench``, ``pack``,
``inspect``) and the benchmarks behind ``nopad bench``. They may import anything in nopad; nothing
in the library imports them."""
