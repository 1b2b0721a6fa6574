"""The slots of the engine's stats row, ``[nan, pos_inf, neg_inf, zeros, max_abs, scale, ssq]``.

Defined here, without torch, so the host side (:mod:`gradaudit.stats_table`) reads the
same slots as the device side (:mod:`gradaudit.engine.stats`, which documents the row).
"""

NAN, POS_INF, NEG_INF, ZEROS, MAX_ABS, SCALE, SSQ = range(7)
ROW_WIDTH = 7
