"""LightningCLI with FiveDStrategy: Lightning's own way to configure a run, from a YAML file.

    python examples/lightning_cli/train.py fit --config examples/lightning_cli/config.yaml

Every strategy setting is a `trainer.strategy.init_args` key (FiveDStrategy's keyword
arguments); the config leaves them all at their defaults, so the planner picks the layout.
Print the full config, defaults included, with `--print_config`. Needs
`pip install 'lightning-5d[cli]'` (jsonargparse).
"""

from lightning.pytorch.cli import LightningCLI

import lightning_5d  # noqa: F401  (registers strategy="5d" and makes class_path lightning_5d.FiveDStrategy importable)
from lightning_5d.console import quiet_third_party_notices
from lightning_5d.models import LlamaLM, TextDataModule


def main() -> None:
    quiet_third_party_notices()
    LightningCLI(LlamaLM, TextDataModule)


if __name__ == "__main__":
    main()
