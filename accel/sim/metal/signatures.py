"""The method signatures Apple's headers declare, which every cast of ``objc_msgSend`` must match.

:data:`DECLARED` maps each simulated selector to its return and argument types, as
Objective-C type names of ``accel.backends._objc.C_TYPES``; the sender in :mod:`.messaging`
refuses a cast whose C types differ from these by kind or size (on a Mac the registers would
not match).  A selector the simulator implements needs its declaration here.
"""

from __future__ import annotations

from typing import Dict, Tuple

# ---------------------------------------------------------------------------
# Declared signatures (Apple's headers: Metal/*.h, Foundation/NSString.h,
# NSError.h, NSObject.h).  Types are Objective-C names from
# accel.backends._objc.C_TYPES.  The simulator checks every cast against these.
# ---------------------------------------------------------------------------
DECLARED: Dict[str, Tuple[str, Tuple[str, ...]]] = {
    # NSObject / Foundation
    "new": ("id", ()), "alloc": ("id", ()), "init": ("id", ()),
    "retain": ("id", ()), "release": ("void", ()), "autorelease": ("id", ()),
    "retainCount": ("NSUInteger", ()),
    "stringWithUTF8String:": ("id", ("const char *",)),
    "UTF8String": ("const char *", ()),
    "localizedDescription": ("id", ()),
    "code": ("NSInteger", ()),
    # MTLDevice
    "name": ("id", ()),
    "registryID": ("uint64_t", ()),
    "recommendedMaxWorkingSetSize": ("uint64_t", ()),
    "currentAllocatedSize": ("NSUInteger", ()),
    "hasUnifiedMemory": ("BOOL", ()),
    "maxBufferLength": ("NSUInteger", ()),
    "newCommandQueue": ("id", ()),
    "newBufferWithLength:options:": ("id", ("NSUInteger", "NSUInteger")),
    "newBufferWithBytes:length:options:": ("id", ("const void *", "NSUInteger", "NSUInteger")),
    "newSharedEvent": ("id", ()),
    "newLibraryWithSource:options:error:": ("id", ("id", "id", "id *")),
    "newComputePipelineStateWithFunction:error:": ("id", ("id", "id *")),
    # MTLBuffer
    "contents": ("void *", ()),
    "length": ("NSUInteger", ()),        # also -[NSString length]
    # MTLCommandQueue / MTLCommandBuffer
    "commandBuffer": ("id", ()),
    "commit": ("void", ()),
    "waitUntilCompleted": ("void", ()),
    "status": ("NSUInteger", ()),
    "error": ("id", ()),
    "GPUStartTime": ("CFTimeInterval", ()),
    "GPUEndTime": ("CFTimeInterval", ()),
    "encodeSignalEvent:value:": ("void", ("id", "uint64_t")),
    "encodeWaitForEvent:value:": ("void", ("id", "uint64_t")),
    "blitCommandEncoder": ("id", ()),
    "computeCommandEncoder": ("id", ()),
    # MTLSharedEvent
    "signaledValue": ("uint64_t", ()),
    "setSignaledValue:": ("void", ("uint64_t",)),
    # encoders
    "endEncoding": ("void", ()),
    "copyFromBuffer:sourceOffset:toBuffer:destinationOffset:size:":
        ("void", ("id", "NSUInteger", "id", "NSUInteger", "NSUInteger")),
    "fillBuffer:range:value:": ("void", ("id", "NSRange", "uint8_t")),
    "setComputePipelineState:": ("void", ("id",)),
    "setBuffer:offset:atIndex:": ("void", ("id", "NSUInteger", "NSUInteger")),
    "setBytes:length:atIndex:": ("void", ("const void *", "NSUInteger", "NSUInteger")),
    "setThreadgroupMemoryLength:atIndex:": ("void", ("NSUInteger", "NSUInteger")),
    "dispatchThreadgroups:threadsPerThreadgroup:": ("void", ("MTLSize", "MTLSize")),
    "dispatchThreads:threadsPerThreadgroup:": ("void", ("MTLSize", "MTLSize")),
    # MTLCompileOptions, MTLLibrary, MTLFunction, MTLComputePipelineState
    "setFastMathEnabled:": ("void", ("BOOL",)),
    "newFunctionWithName:": ("id", ("id",)),
    "maxTotalThreadsPerThreadgroup": ("NSUInteger", ()),
    "threadExecutionWidth": ("NSUInteger", ()),
    "staticThreadgroupMemoryLength": ("NSUInteger", ()),
}
