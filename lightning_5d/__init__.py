"""lightning_5d: 5D parallel training for existing LightningModules."""

__version__ = "0.1.0"
