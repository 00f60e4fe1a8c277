"""Typed configuration: dataclasses, read strictly from YAML/dicts (see :mod:`megarl.config.loader`)."""

from megarl.config.loader import from_dict

__all__ = ["from_dict"]
