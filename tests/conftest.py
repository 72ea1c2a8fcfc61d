import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
# tiny models: one thread is fastest (no thread hand-offs per op), and it keeps the suite
# steady when other jobs share the 2 cores; tests on the real pair set their own count
torch.set_num_threads(1)

# transformers' continuous-batching module gives its logger a handler bound to whatever sys.stderr
# is when the module is first imported; imported inside a capsys test that stream is closed
# afterwards and every later warning prints "Logging error". Importing it here, under pytest's
# session-wide capture, binds it to a stream that lives for the whole run.
import transformers.generation.continuous_batching.utils  # noqa: E402,F401

from tiny import save_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(draft_dir, target_dir): tiny random models with one shared 32-token tokenizer."""
    root = tmp_path_factory.mktemp("tiny_pair")
    draft = save_model(root / "draft", vocab_size=32, hidden_size=16, seed=1, logit_scale=4.0)
    target = save_model(root / "target", vocab_size=32, hidden_size=24, seed=2, logit_scale=4.0)
    return draft, target
