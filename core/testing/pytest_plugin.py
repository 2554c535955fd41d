"""pytest plugin ``ppmedia`` (entry point ``pytest11``): the testing kit as fixtures.

Loaded automatically wherever ppmedia is installed (``-p no:ppmedia`` turns it off). Loading it
imports nothing heavy: transformers and the tiny models are imported by the fixtures, when a test asks.

Fixtures:

* ``ppmedia_kit`` (session): a :class:`ppmedia.testing.kit.Kit`; ``ppmedia_kit.family(name_or_module,
  plugins=[...])`` gives a :class:`~ppmedia.testing.kit.FamilyKit` whose model is built once per session.
* ``ppmedia_host_reads``: a started :class:`ppmedia.HostReadCounter` (``.total``, ``.counts``).

Option ``--ppmedia-write-goldens``: ``FamilyKit.check_goldens`` (re)writes the golden files first.

Marker ``multiprocess``: a test that spawns real worker processes (``FamilyKit.check_pipeline_parity``);
registered here, so a plugin's suite may run with ``--strict-markers`` and deselect them with
``-m "not multiprocess"``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

import pytest

if TYPE_CHECKING:
    from ..producer.hostreads import HostReadCounter
    from .kit import Kit


#: the markers the kit's users put on their tests (name: description), registered in every session.
MARKERS = {"multiprocess": "spawns real worker processes (gloo on 127.0.0.1), e.g. FamilyKit.check_pipeline_parity"}


def pytest_configure(config: Any) -> None:
    for name, description in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {description}")


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("ppmedia", "ppmedia testing kit")
    group.addoption(
        "--ppmedia-write-goldens",
        action="store_true",
        default=False,
        help="ppmedia: (re)write the golden files that FamilyKit.check_goldens checks, then check them",
    )


@pytest.fixture(scope="session")
def ppmedia_kit(request: pytest.FixtureRequest) -> Kit:
    """The ppmedia testing kit: ``ppmedia_kit.family("my_plugin.tiny", plugins=["my_plugin"])``."""
    from .kit import Kit

    return Kit(write_goldens=bool(request.config.getoption("ppmedia_write_goldens")))


@pytest.fixture
def ppmedia_host_reads() -> Iterator[HostReadCounter]:
    """A :class:`ppmedia.HostReadCounter` active for the test: host reads of tensor data are counted."""
    from ..producer.hostreads import HostReadCounter

    with HostReadCounter() as reads:
        yield reads
