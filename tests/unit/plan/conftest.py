import sys
from pathlib import Path

# The test modules import their shared models as `plan_models` (tests use importlib mode).
sys.path.insert(0, str(Path(__file__).parent))
