import sys

from fusepatch.cli import main

sys.exit(main())
