// Command-line parsing shared by the launch/ tools.
#pragma once
#include <boost/program_options.hpp>
#include <iostream>

namespace moeut {

// Stores argv into the variables opts binds (po::error on a bad command line); for --help,
// prints the options and returns false.
inline bool parse_options(int argc, char** argv, const boost::program_options::options_description& opts) {
  namespace po = boost::program_options;
  po::variables_map vm;
  po::store(po::parse_command_line(argc, argv, opts), vm);
  if (vm.count("help")) {
    std::cout << opts << "\n";
    return false;
  }
  po::notify(vm);
  return true;
}

}  // namespace moeut
