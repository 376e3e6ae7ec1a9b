# Owned by the model work: the training model, data loading and tessera-worker.

set(TESSERA_MODEL_SOURCES
    worker/batch_loader.cc
    worker/batch_loader.h
    worker/idx_reader.cc
    worker/idx_reader.h
    worker/mlp.cc
    worker/mlp.h
    worker/mlp_cuda.h
    worker/train_flags.cc
    worker/train_flags.h)
if(TESSERA_HAVE_CUDA)
  list(APPEND TESSERA_MODEL_SOURCES worker/cuda/mlp_cuda.cu)
  set(TESSERA_MODEL_CUDA_DEPS CUDA::cublas CUDA::cudart)
else()
  list(APPEND TESSERA_MODEL_SOURCES worker/mlp_cuda_stub.cc)
  set(TESSERA_MODEL_CUDA_DEPS)
endif()
list(TRANSFORM TESSERA_MODEL_SOURCES PREPEND ${PROJECT_SOURCE_DIR}/)

tessera_library(NAME model
  SOURCES ${TESSERA_MODEL_SOURCES}
  PUBLIC_DEPS absl::status absl::statusor absl::strings absl::span absl::synchronization
              Threads::Threads
  DEPS PkgConfig::OPENBLAS ZLIB::ZLIB ${TESSERA_MODEL_CUDA_DEPS})
if(TESSERA_HAVE_CUDA)
  set_target_properties(tessera_model PROPERTIES CUDA_STANDARD 17 CUDA_STANDARD_REQUIRED ON)
  target_compile_options(tessera_model PRIVATE
      $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra,-Wno-unused-parameter>)
endif()

# The training program; worker/CMakeLists.txt defines tessera::client before this file.
tessera_executable(NAME tessera-worker
  SOURCES ${PROJECT_SOURCE_DIR}/worker/tessera_worker_main.cc
  DEPS tessera::model tessera::client absl::strings)
install(TARGETS tessera-worker RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
