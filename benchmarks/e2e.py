"""End-to-end training step on one GPU: BF16 vs fp8train recipes vs torchao float8 (`fp8train bench`).

    PYTHONPATH=. python benchmarks/e2e.py --models qwen2.5-1.5b qwen2.5-7b:16 --seq 4096 8192 \
        --modes eager compiled --profile --out e2e.jsonl

The harness lives in `fp8train/bench.py` so that an installed package has it too (`fp8train bench`).
"""

import sys

from fp8train.bench import main

if __name__ == "__main__":
    sys.exit(main())
