import sys

from fusepatch.tools.cli import main

sys.exit(main())
