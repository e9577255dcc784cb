// The extension module mmseg_gf._patch_ops as one translation unit (what
// setup.py compiles by default; MMSEG_GF_UNITY_BUILD=0 compiles the files
// below one by one instead, for quicker rebuilds while editing one of
// them). Each of them includes torch's headers, whose parsing took most of
// a file's compile time: here they are parsed once. The files keep their
// own helpers in anonymous namespaces with distinct names, so they compile
// together unchanged; bindings.cpp comes last (it binds all of them).

#include "patch_kernels.cpp"
#include "output_recycler.cpp"
#include "cpu_dispatch.cpp"
#include "collapsed_backward.cpp"
#include "filtered_conv_node.cpp"
#include "bilinear_backward.cpp"
#include "token_grid_backward.cpp"
#include "token_rows_avx512.cpp"
#include "bindings.cpp"
