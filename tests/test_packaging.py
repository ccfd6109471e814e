"""pyproject.toml as setuptools reads it for `make`'s `pip install -e .`: no deprecation box."""

from __future__ import annotations

import warnings
from pathlib import Path

from setuptools.config.pyprojecttoml import apply_configuration
from setuptools.dist import Distribution

PYPROJECT = Path(__file__).parents[1] / "pyproject.toml"


def test_setuptools_reads_pyproject_without_a_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        distribution = apply_configuration(Distribution(), PYPROJECT)
    assert [str(warning.message) for warning in caught] == []
    assert distribution.metadata.license_expression == "Apache-2.0"
