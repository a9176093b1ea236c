"""``python -m mmengine_deepspeed``: same as the ``mmengine-deepspeed`` command."""
import sys

from .cli import main

sys.exit(main())
