from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("path", "abort_in_flight")
    PATH_FIELD_NUMBER: _ClassVar[int]
    ABORT_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    path: str
    abort_in_flight: bool
    def __init__(self, path: _Optional[str] = ..., abort_in_flight: _Optional[bool] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("params_replaced", "freed_bytes", "seconds")
    PARAMS_REPLACED_FIELD_NUMBER: _ClassVar[int]
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    params_replaced: int
    freed_bytes: int
    seconds: float
    def __init__(self, params_replaced: _Optional[int] = ..., freed_bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class SleepRequest(_message.Message):
    __slots__ = ("level", "discard")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    DISCARD_FIELD_NUMBER: _ClassVar[int]
    level: int
    discard: bool
    def __init__(self, level: _Optional[int] = ..., discard: _Optional[bool] = ...) -> None: ...

class SleepResponse(_message.Message):
    __slots__ = ("freed_bytes",)
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    freed_bytes: int
    def __init__(self, freed_bytes: _Optional[int] = ...) -> None: ...

class WakeUpRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WakeUpResponse(_message.Message):
    __slots__ = ("placed_bytes",)
    PLACED_BYTES_FIELD_NUMBER: _ClassVar[int]
    placed_bytes: int
    def __init__(self, placed_bytes: _Optional[int] = ...) -> None: ...

class IsSleepingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IsSleepingResponse(_message.Message):
    __slots__ = ("sleeping", "level", "device_bytes")
    SLEEPING_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    sleeping: bool
    level: int
    device_bytes: int
    def __init__(self, sleeping: _Optional[bool] = ..., level: _Optional[int] = ..., device_bytes: _Optional[int] = ...) -> None: ...
