"""The package layering (DESIGN.md) holds: the import-linter contracts in pyproject.toml are kept.

models / quant import no engine, train or rl; engine and train never import each other nor the RL
loop; Sample, prompt encoding, config and pass@k are leaves. lint-imports reads every import,
function-level ones included, so a lazy import cannot hide a broken layer.
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint) if lint.exists() else "lint-imports", "--no-cache"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout
