"""Vision encoders of the vision-language families, and what a prompt's images need
besides their embeddings (the multimodal rotary positions): plain PyTorch modules
the family's model file (shared/model/models/<name>.py) holds under ``visual``."""
