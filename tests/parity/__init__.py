"""The parity tier (marker `parity`): our numerics against independent references,
transformers' models and tokenizers, PyTorch references of the Triton kernels (run
under Triton's interpreter) and the CLI's output against transformers' generate."""
