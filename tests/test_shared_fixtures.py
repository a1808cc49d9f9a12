"""The suite's own shared-fixture helper (conftest.cached): built once per session whoever asks, and a failed build
fails the next asker at once instead of building again."""

import pytest
from conftest import cached


def test_a_cached_folder_is_built_once_and_then_reused(tmp_path_factory):
    built = []

    def build(folder):
        folder.mkdir()
        (folder / "made").write_text("once")
        built.append(folder)

    first = cached(tmp_path_factory, "suite-test-once", build)
    again = cached(tmp_path_factory, "suite-test-once", build)
    assert first == again and built == [first] and (first / "made").read_text() == "once"


def test_a_failed_build_fails_the_next_asker_without_building_again(tmp_path_factory):
    built = []

    def broken(folder):
        built.append(folder)
        raise RuntimeError("the build broke")

    with pytest.raises(RuntimeError, match="the build broke"):
        cached(tmp_path_factory, "suite-test-broken", broken)
    with pytest.raises(pytest.fail.Exception, match="RuntimeError: the build broke"):
        cached(tmp_path_factory, "suite-test-broken", broken)
    assert len(built) == 1
