"""File names inside published checkpoints that several parts of omnistage read or write (the tiny-model
builders, the stage engines, the checkpoint table): one home each. Torch-free, so anything may import it."""

PROCESSOR_CONFIG = "preprocessor_config.json"  # the processor's settings: audio features, image and video patches
# The omni Thinkers' encoders, served inline or by an encoder stage: their tensors' name prefixes.
THINKER_TOWERS = ("thinker.visual.", "thinker.audio_tower.")
QWEN2_5_OMNI_SPEAKERS = "spk_dict.pt"  # Qwen2.5-Omni's speakers (conditioning, reference mel, bos token), at the root
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # a fast tokenizer's files: either one will do
