import pytest

from rlmega.data import build_char_tokenizer


@pytest.fixture(scope="session")
def char_tokenizer():
    return build_char_tokenizer()
