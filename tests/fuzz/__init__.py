"""A differential fuzzer for te_v2: random small programs run eagerly, through te_v2 and through
an eager emulation of te_v2's kernels, compared.

``programs`` generates them, ``oracle`` runs and compares one, ``shrink`` drops what a failure
does not need, ``campaign`` checks programs until a budget is spent; ``python -m tests.fuzz``
runs one for a time budget (``make fuzz``), ``tests/cpu/test_fuzz.py`` a fixed one.
"""
