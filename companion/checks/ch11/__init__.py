"""Checks for chapter 11, fewer bits, in the notebook's order: block-wise codes, an 8-bit Adam
step, stochastic rounding, NF4, which layout fits, and which codes to keep a tensor's moments in.

Modules, one per exercise, in the notebook's order: `blockwise`, `adam8bit_step`,
`stochastic_rounding`, `nf4_block`, `layout_choice`, `state_codes`; `_common` holds the codes'
nearest-level test three of them share."""
from companion.checks.ch11.blockwise import check_blockwise
from companion.checks.ch11.adam8bit_step import adam8bit_block, check_adam8bit_block
from companion.checks.ch11.stochastic_rounding import check_stochastic_rounding
from companion.checks.ch11.nf4_block import check_nf4_block
from companion.checks.ch11.layout_choice import (CHOICES, check_pick_layout, layout_bytes,
                                                 pick_layout)
from companion.checks.ch11.state_codes import (check_state_codes, choose_state_codes,
                                               state_bytes_per_value)

__all__ = ["check_blockwise", "check_adam8bit_block", "check_stochastic_rounding",
           "check_nf4_block", "check_pick_layout", "check_state_codes"]
