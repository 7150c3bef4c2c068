#pragma once
// A 2-D row-major strided view of memory owned by someone else (the trainer,
// a backend buffer). Element (i, j) lives at
//   data + (i * row_stride + j) * DTypeSize(dtype).
// The column stride is always 1: a TP column block of a row-major matrix is a
// view with row_stride = full column count, never a copy (docs/ARCHITECTURE.md
// "Memory registration"). 1-D tensors are views with rows = 1. Where `data`
// points (host or device) is the business of the backend that receives the
// view.
#include <cstdint>

#include "core/common/dtype.h"

namespace muond {

struct MatrixView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;  // elements between the starts of two rows

  int64_t numel() const { return rows * cols; }
  bool contiguous() const { return row_stride == cols || rows <= 1; }
  // Bytes from `data` to one past the last element (0 for an empty view).
  int64_t span_bytes() const {
    if (rows == 0 || cols == 0) return 0;
    return ((rows - 1) * row_stride + cols) * int64_t(DTypeSize(dtype));
  }
  // The sub-block [row0, row0 + nrows) x [col0, col0 + ncols).
  MatrixView Block(int64_t row0, int64_t col0, int64_t nrows,
                   int64_t ncols) const {
    MatrixView v = *this;
    v.data = static_cast<char*>(data) +
             (row0 * row_stride + col0) * int64_t(DTypeSize(dtype));
    v.rows = nrows;
    v.cols = ncols;
    return v;
  }
};

// `v`'s shape and dtype with no memory behind it: an output a kernel is told
// to leave unwritten (Backend::MuonMomentum's momentum_out or out).
inline MatrixView Absent(MatrixView v) {
  v.data = nullptr;
  return v;
}
inline bool IsAbsent(const MatrixView& v) { return v.data == nullptr; }

// `v`'s memory read as `dtype`, an element type of the same size (bf16 and
// fp16 share L_i's buffers: NsResultDType).
inline MatrixView AsDType(MatrixView v, DType dtype) {
  v.dtype = dtype;
  return v;
}

// A contiguous row-major view of `rows` x `cols` elements at `data`.
inline MatrixView ContiguousView(void* data, DType dtype, int64_t rows,
                                 int64_t cols) {
  return MatrixView{data, dtype, rows, cols, cols};
}

}  // namespace muond
