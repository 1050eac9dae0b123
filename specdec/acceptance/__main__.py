import sys

from specdec.acceptance.cli import main

sys.exit(main())
