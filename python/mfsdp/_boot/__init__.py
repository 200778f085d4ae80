# SPDX-License-Identifier: Apache-2.0
"""Directory put on PYTHONPATH by mfsdp-run; holds only its sitecustomize."""
