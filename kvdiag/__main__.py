import sys

from kvdiag.cli import main

sys.exit(main())
