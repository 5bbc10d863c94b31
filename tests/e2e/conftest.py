import pytest

from tests.support.daemon import Daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("daemon")).start()
    yield d
    d.close()
