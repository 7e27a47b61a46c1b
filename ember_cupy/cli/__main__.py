import sys

from ember_cupy.cli import main

sys.exit(main())
