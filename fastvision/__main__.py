"""``python -m fastvision`` is the ``fastvision`` command."""
import sys

from .cli import main

sys.exit(main())
