"""Skip markers for what a test needs from the machine's toolchain."""

from __future__ import annotations

import os
import shutil

import pytest

# Inductor's CPU backend compiles C++: it needs a compiler ($CXX or g++ / clang++)
needs_cxx = pytest.mark.skipif(not any(shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "clang++") if c),
                               reason="no C++ compiler for Inductor's CPU backend")
