"""`python -m adaptive_spec.datagen` (and `accelerate launch -m adaptive_spec.datagen`): the datagen command."""
import sys

from .generate import main

sys.exit(main())
