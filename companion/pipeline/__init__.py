from companion.pipeline.schedules import *
from companion.pipeline.runtime import *
from companion.pipeline import schedules as _s, runtime as _r

__all__ = _s.__all__ + _r.__all__
