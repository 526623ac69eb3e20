import os
import sys

# One torch thread per model process: more threads under load slow every stage down (DESIGN.md).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from stage_service.server import main

if __name__ == "__main__":
    sys.exit(main())
