import os
import sys
from pathlib import Path

import torch

# tests/dist_utils.py (shared multi-process helpers) importable as `dist_utils` from every folder.
sys.path.insert(0, str(Path(__file__).resolve().parent))

# One intra-op thread in the pytest process: the suite's models are tiny (two threads buy little)
# and multi-process tests run their ranks beside it; an idle OpenMP pool spinning against those
# ranks on a 2-core machine made single-process tests 10-20x slower. Spawned ranks get theirs
# from Lightning's launcher (cores // processes). LDT_TEST_THREADS overrides.
torch.set_num_threads(int(os.environ.get("LDT_TEST_THREADS", "1")))
