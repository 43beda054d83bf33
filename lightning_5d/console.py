"""Keep a run's console to the lines its user can act on.

Called by our entry points (the ``l5d train`` worker, the LightningCLI example), never on
``import lightning_5d``: a library must not change the warning filters of its host program.
Each filter matches one message of one category, so anything else still prints.
"""

from __future__ import annotations

import logging
import warnings

# Lightning's advertisements for its hosted services ("💡 Tip: ... try installing litlogger /
# litmodels"), logged on rank 0 by every Trainer: nothing in the run to fix.
_TIP_PREFIX = "💡 Tip:"
_RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_TIP_PREFIX)


_DROP_TIPS = _DropTips()


def quiet_third_party_notices() -> None:
    """Silence the notices a user of lightning_5d cannot act on; idempotent."""
    # Lightning 2.6 builds torch's deprecated LeafSpec itself (lightning/pytorch/utilities/_pytree.py);
    # torch warns once per process, i.e. once per rank. Only a Lightning release can fix it.
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
    )
    for name in _RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        if _DROP_TIPS not in logger.filters:
            logger.addFilter(_DROP_TIPS)
