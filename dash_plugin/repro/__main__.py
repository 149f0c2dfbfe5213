import sys

from dash_plugin.repro.cli import main

sys.exit(main())
