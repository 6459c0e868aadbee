"""A module whose import is interrupted: its body sends its own process SIGTERM, the way a Ctrl-C lands while a
pipeline imports a heavy dependency (vLLM or transformers take seconds). ``faulty_pipelines`` site ``import``."""

import os
import signal
import time

os.kill(os.getpid(), signal.SIGTERM)  # the handler runs in this module's body: inside the import
time.sleep(0.05)
