"""``make bench``: te_v2 side by side with BF16 eager, te.Linear eager and Thunder's built-in TE
executor, on Llama-3-8B linear shapes (see ``run.py``)."""
