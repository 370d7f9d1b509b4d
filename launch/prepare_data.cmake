# moeut-prepare-data: text or JSON lines -> SentencePiece model + token files, and llm.c / nanoGPT
# token files converted (docs/DATA.md).
# Included from launch/CMakeLists.txt; needs the moeut_core library (core/token_file.cpp) and the
# Boost and SentencePiece targets that the top-level CMakeLists.txt finds.
find_package(Threads REQUIRED)  # encoding runs on --threads worker threads
add_executable(moeut-prepare-data ${CMAKE_CURRENT_LIST_DIR}/prepare_data.cpp ${CMAKE_CURRENT_LIST_DIR}/prepare_input.cpp
               ${CMAKE_CURRENT_LIST_DIR}/prepare_encode.cpp
               ${CMAKE_CURRENT_LIST_DIR}/llmc_import.cpp)
target_link_libraries(moeut-prepare-data PRIVATE moeut_core Boost::program_options PkgConfig::SENTENCEPIECE
                      Threads::Threads)
