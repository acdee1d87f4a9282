"""InferMesh's common library: the engine, the model, the Recipe (tokenizer layer)
and KV block format. Services import from here; nothing here imports a service."""
