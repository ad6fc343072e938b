/*
 * tests/cudaemu/include/cudnn.h -- the cuDNN calls of the CUDA backend (backend/cuda/linalg.cu: 2-D
 * convolutions, forward, data and filter gradients, bias add and bias gradient), as the CUDA
 * executor implements them on the CPU (tests/cudaemu/dnn.cc, whose file-top comment says which
 * documented behaviour it encodes). Names are NVIDIA's; values are ours.
 */
#ifndef FSDP_CUDAEMU_CUDNN_H
#define FSDP_CUDAEMU_CUDNN_H

#include <cuda_runtime.h>

#include <stddef.h>

typedef enum {
  CUDNN_STATUS_SUCCESS = 0,
  CUDNN_STATUS_NOT_INITIALIZED = 1001,
  CUDNN_STATUS_BAD_PARAM = 2000,
  CUDNN_STATUS_NOT_SUPPORTED = 3000,
  CUDNN_STATUS_INTERNAL_ERROR = 4000,
  CUDNN_STATUS_EXECUTION_FAILED = 5000,
} cudnnStatus_t;

typedef enum {
  CUDNN_DATA_FLOAT = 0,
  CUDNN_DATA_DOUBLE = 1,
  CUDNN_DATA_HALF = 2,
  CUDNN_DATA_BFLOAT16 = 9
} cudnnDataType_t;
typedef enum { CUDNN_TENSOR_NCHW = 0, CUDNN_TENSOR_NHWC = 1 } cudnnTensorFormat_t;
typedef enum { CUDNN_CONVOLUTION = 0, CUDNN_CROSS_CORRELATION = 1 } cudnnConvolutionMode_t;
typedef enum {
  CUDNN_DEFAULT_MATH = 0,
  CUDNN_TENSOR_OP_MATH = 1,
  CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION = 2,
  CUDNN_FMA_MATH = 3,
} cudnnMathType_t;
typedef enum { CUDNN_DETERMINISTIC = 1, CUDNN_NON_DETERMINISTIC = 0 } cudnnDeterminism_t;

typedef enum {
  CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_GEMM = 0,
  CUDNN_CONVOLUTION_FWD_ALGO_IMPLICIT_PRECOMP_GEMM = 1,
  CUDNN_CONVOLUTION_FWD_ALGO_GEMM = 2,
} cudnnConvolutionFwdAlgo_t;
typedef enum {
  CUDNN_CONVOLUTION_BWD_DATA_ALGO_0 = 0,
  CUDNN_CONVOLUTION_BWD_DATA_ALGO_1 = 1,
} cudnnConvolutionBwdDataAlgo_t;
typedef enum {
  CUDNN_CONVOLUTION_BWD_FILTER_ALGO_0 = 0,
  CUDNN_CONVOLUTION_BWD_FILTER_ALGO_1 = 1,
} cudnnConvolutionBwdFilterAlgo_t;

typedef struct {
  cudnnConvolutionFwdAlgo_t algo;
  cudnnStatus_t status;
  float time;
  size_t memory;
  cudnnDeterminism_t determinism;
  cudnnMathType_t mathType;
  int reserved[3];
} cudnnConvolutionFwdAlgoPerf_t;
typedef struct {
  cudnnConvolutionBwdDataAlgo_t algo;
  cudnnStatus_t status;
  float time;
  size_t memory;
  cudnnDeterminism_t determinism;
  cudnnMathType_t mathType;
  int reserved[3];
} cudnnConvolutionBwdDataAlgoPerf_t;
typedef struct {
  cudnnConvolutionBwdFilterAlgo_t algo;
  cudnnStatus_t status;
  float time;
  size_t memory;
  cudnnDeterminism_t determinism;
  cudnnMathType_t mathType;
  int reserved[3];
} cudnnConvolutionBwdFilterAlgoPerf_t;

typedef struct fsdp_emu_dnn* cudnnHandle_t;
typedef struct fsdp_emu_dnn_tensor* cudnnTensorDescriptor_t;
typedef struct fsdp_emu_dnn_filter* cudnnFilterDescriptor_t;
typedef struct fsdp_emu_dnn_conv* cudnnConvolutionDescriptor_t;

const char* cudnnGetErrorString(cudnnStatus_t s);
cudnnStatus_t cudnnCreate(cudnnHandle_t* h);
cudnnStatus_t cudnnDestroy(cudnnHandle_t h);
cudnnStatus_t cudnnSetStream(cudnnHandle_t h, cudaStream_t s);

cudnnStatus_t cudnnCreateTensorDescriptor(cudnnTensorDescriptor_t* d);
cudnnStatus_t cudnnDestroyTensorDescriptor(cudnnTensorDescriptor_t d);
cudnnStatus_t cudnnSetTensor4dDescriptor(cudnnTensorDescriptor_t d, cudnnTensorFormat_t format, cudnnDataType_t type,
                                         int n, int c, int h, int w);
cudnnStatus_t cudnnCreateFilterDescriptor(cudnnFilterDescriptor_t* d);
cudnnStatus_t cudnnDestroyFilterDescriptor(cudnnFilterDescriptor_t d);
cudnnStatus_t cudnnSetFilter4dDescriptor(cudnnFilterDescriptor_t d, cudnnDataType_t type, cudnnTensorFormat_t format,
                                         int k, int c, int h, int w);
cudnnStatus_t cudnnCreateConvolutionDescriptor(cudnnConvolutionDescriptor_t* d);
cudnnStatus_t cudnnDestroyConvolutionDescriptor(cudnnConvolutionDescriptor_t d);
cudnnStatus_t cudnnSetConvolution2dDescriptor(cudnnConvolutionDescriptor_t d, int pad_h, int pad_w, int stride_h,
                                              int stride_w, int dilation_h, int dilation_w, cudnnConvolutionMode_t mode,
                                              cudnnDataType_t compute_type);
cudnnStatus_t cudnnSetConvolutionGroupCount(cudnnConvolutionDescriptor_t d, int groups);
cudnnStatus_t cudnnSetConvolutionMathType(cudnnConvolutionDescriptor_t d, cudnnMathType_t math);

cudnnStatus_t cudnnGetConvolutionForwardAlgorithm_v7(cudnnHandle_t h, cudnnTensorDescriptor_t x,
                                                     cudnnFilterDescriptor_t w, cudnnConvolutionDescriptor_t conv,
                                                     cudnnTensorDescriptor_t y, int requested, int* returned,
                                                     cudnnConvolutionFwdAlgoPerf_t* perf);
cudnnStatus_t cudnnGetConvolutionBackwardDataAlgorithm_v7(cudnnHandle_t h, cudnnFilterDescriptor_t w,
                                                          cudnnTensorDescriptor_t dy, cudnnConvolutionDescriptor_t conv,
                                                          cudnnTensorDescriptor_t dx, int requested, int* returned,
                                                          cudnnConvolutionBwdDataAlgoPerf_t* perf);
cudnnStatus_t cudnnGetConvolutionBackwardFilterAlgorithm_v7(cudnnHandle_t h, cudnnTensorDescriptor_t x,
                                                            cudnnTensorDescriptor_t dy,
                                                            cudnnConvolutionDescriptor_t conv,
                                                            cudnnFilterDescriptor_t dw, int requested, int* returned,
                                                            cudnnConvolutionBwdFilterAlgoPerf_t* perf);

// y = alpha conv(x, w) + beta y, and the gradients, queued on the handle's stream
cudnnStatus_t cudnnConvolutionForward(cudnnHandle_t h, const void* alpha, cudnnTensorDescriptor_t xd, const void* x,
                                      cudnnFilterDescriptor_t wd, const void* w, cudnnConvolutionDescriptor_t conv,
                                      cudnnConvolutionFwdAlgo_t algo, void* workspace, size_t workspace_bytes,
                                      const void* beta, cudnnTensorDescriptor_t yd, void* y);
cudnnStatus_t cudnnConvolutionBackwardData(cudnnHandle_t h, const void* alpha, cudnnFilterDescriptor_t wd,
                                           const void* w, cudnnTensorDescriptor_t dyd, const void* dy,
                                           cudnnConvolutionDescriptor_t conv, cudnnConvolutionBwdDataAlgo_t algo,
                                           void* workspace, size_t workspace_bytes, const void* beta,
                                           cudnnTensorDescriptor_t dxd, void* dx);
cudnnStatus_t cudnnConvolutionBackwardFilter(cudnnHandle_t h, const void* alpha, cudnnTensorDescriptor_t xd,
                                             const void* x, cudnnTensorDescriptor_t dyd, const void* dy,
                                             cudnnConvolutionDescriptor_t conv, cudnnConvolutionBwdFilterAlgo_t algo,
                                             void* workspace, size_t workspace_bytes, const void* beta,
                                             cudnnFilterDescriptor_t dwd, void* dw);
cudnnStatus_t cudnnConvolutionBackwardBias(cudnnHandle_t h, const void* alpha, cudnnTensorDescriptor_t dyd,
                                           const void* dy, const void* beta, cudnnTensorDescriptor_t dbd, void* db);
// c = alpha a + beta c, a broadcast over c's dimensions of size 1 in a (the bias add)
cudnnStatus_t cudnnAddTensor(cudnnHandle_t h, const void* alpha, cudnnTensorDescriptor_t ad, const void* a,
                             const void* beta, cudnnTensorDescriptor_t cd, void* c);

#endif
