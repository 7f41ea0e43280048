// What the C++ kernels' Python bindings share.
#pragma once

#include <torch/extension.h>

namespace pagedserve {

// an op bound with this runs without the GIL, as torch's own do: the event loop's thread runs its Python meanwhile
inline const auto kReleaseGil = py::call_guard<py::gil_scoped_release>();

}  // namespace pagedserve
