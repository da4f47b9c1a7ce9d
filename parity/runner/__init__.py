"""parity's in-process prefill graph runner: the LM body, its graphs (CUDA or emulated), the DeepStack slot and tap.
May import the base modules of parity/ (evidence, errors) only; torch, no other layer."""
