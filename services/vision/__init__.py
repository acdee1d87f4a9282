"""The vision stage (E/P/D): runs the model's image processor and vision tower in
batches, keeps the embeddings by image identity and stores them in kvcache, from
which prefill and decode take them."""
