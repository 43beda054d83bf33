import sys
from pathlib import Path

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
# The zoo of differently written models (tests/zoo) is imported as `zoo`.
sys.path.insert(0, str(Path(__file__).parents[1]))
