"""Runtime: ONNX Runtime sessions, torch <-> ORT binding without copies, compiled-entry cache."""

from .cache import LRUCache
from .session import GraphRunner, make_session_options

__all__ = ["GraphRunner", "LRUCache", "make_session_options"]
