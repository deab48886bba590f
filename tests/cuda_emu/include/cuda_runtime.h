// Kernel emulation: see cuda_runtime_api.h here.
#pragma once
#include "cuda_runtime_api.h"
