# SPDX-License-Identifier: Apache-2.0
import sys

from .run import main

sys.exit(main())
