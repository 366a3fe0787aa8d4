// gemv.cu: (being written)
#include "portable.h"
#include "elem.h"
