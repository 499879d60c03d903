"""Where the tests find the checkout's files, wherever a test file sits in tests/."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
TEST_DATA = TESTS / "data"
