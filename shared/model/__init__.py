"""The model side of the engine: what a model is to the engine (``interface``: the
``CausalLM`` the runner calls and the ``ModelEntry`` a model file exports), the model
files and their registry (``models/``), the config every model shares (``config``,
torch-free), the layers the families build on (``layers``, ``attention``, ``moe``...),
the kernels (``kernels/``) and the one table that picks them (``ops``), and the
checkpoint loader (``loader``). It imports nothing of the engine above it."""
