// DeviceMirror without CUDA: nothing to mirror onto.
#include "engine/device_mirror.h"

#include "core/error.h"

namespace zinc {

std::unique_ptr<DeviceMirror> DeviceMirror::make(const std::vector<int64_t>&, DType) {
  throw Error("device \"cuda\": zinc was built without CUDA");
}

}  // namespace zinc
