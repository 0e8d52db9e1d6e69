"""The names of the files an Arctic checkpoint folder holds.

Kept apart from :mod:`arctic_core.serving.checkpoint_folders` (which writes checkpoints and imports
the config) so that the config's own modules, and adapters placing a checkpoint's Hugging Face
export where their framework expects it, can name them without importing the server side.
"""

STATE_FILE = "arctic_state.json"
"""Written last into every checkpoint folder: its presence marks a complete checkpoint."""
HF_EXPORT = "hf"
"""The checkpoint's subfolder holding the policy as a Hugging Face model (``export_hf=True``)."""
